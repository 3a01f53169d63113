"""docs/kubernetes/lingvo_ext_job.yaml read as Kubernetes would read it.

The manifest is YAML in JSON's flow style with `#` comment lines, so a test
reads it without a YAML library.
"""

import json
import os
import re

from tests.support import ROOT

MANIFEST = os.path.join(ROOT, 'docs', 'kubernetes', 'lingvo_ext_job.yaml')


def Documents():
  """The manifest's documents, in order."""
  with open(MANIFEST) as f:
    text = f.read()
  docs = []
  for doc in text.split('\n---\n'):
    lines = [l for l in doc.splitlines() if not l.strip().startswith('#')]
    docs.append(json.loads('\n'.join(lines)))
  return docs


def Jobs():
  """{name: the batch/v1 Job} of the manifest."""
  return {d['metadata']['name']: d for d in Documents() if d['kind'] == 'Job'}


def Flags(args):
  """{flag name: value} of `--name=value` args."""
  out = {}
  for a in args:
    assert a.startswith('--') and '=' in a, a
    name, value = a[2:].split('=', 1)
    out[name] = value
  return out


def PodFailureAction(job, exit_code=None, conditions=()):
  """What a Job's podFailurePolicy does with a failed pod, as Kubernetes.

  The first rule that matches decides: 'Ignore' (a new pod, not counted
  against backoffLimit), 'FailJob', 'Count'; None when no rule matches (the
  failure counts against backoffLimit). A pod that exits 0 is not failed.
  """
  for rule in job['spec'].get('podFailurePolicy', {}).get('rules', ()):
    codes = rule.get('onExitCodes')
    if codes is not None and exit_code is not None:
      values = set(codes['values'])
      hit = (exit_code in values if codes['operator'] == 'In' else
             exit_code not in values)
      if hit:
        return rule['action']
    for c in rule.get('onPodConditions', ()):
      if c['type'] in conditions:
        return rule['action']
  return None


def PodEnv(container, index, job_name):
  """A container's env as Kubernetes sets it in pod `index`.

  $(NAME) refers to an entry defined before it; the Job controller sets the
  completion-index annotation of an Indexed Job's pods.
  """
  annotations = {'batch.kubernetes.io/job-completion-index': str(index)}
  env = {}
  for e in container.get('env', []):
    if 'value' in e:
      env[e['name']] = re.sub(r'\$\((\w+)\)', lambda m: env[m.group(1)],
                              e['value'])
    else:
      path = e['valueFrom']['fieldRef']['fieldPath']
      m = re.fullmatch(r"metadata\.annotations\['([^']+)'\]", path)
      assert m, (job_name, path)
      env[e['name']] = annotations[m.group(1)]
  return env
