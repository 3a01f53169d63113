"""network: free ports on 127.0.0.1 (the private namespace: tests/e2e)."""

import socket

from lingvo_ext.distributed import network


def testFreePortsCanBeBound():
  ports = network.FreePorts(3)
  assert len(set(ports)) == 3
  base = network.FreePortRange(4)
  for p in ports + list(range(base, base + 4)):
    with socket.socket() as s:
      s.bind(('127.0.0.1', p))
