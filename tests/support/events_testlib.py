"""A run's TensorBoard scalars, read back from its event files."""

import glob
import os

import lingvo.compat as tf


def Scalars(event_dir, tag):
  """{step: value} of scalar `tag` in the event files of `event_dir`."""
  values = {}
  for path in sorted(glob.glob(os.path.join(event_dir, 'events.out.*'))):
    for event in tf.train.summary_iterator(path):
      for v in event.summary.value:
        if v.tag == tag:
          values[event.step] = v.simple_value
  return values
