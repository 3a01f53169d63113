"""The GPipe NMT experiment of mt_testlib with an `Inference()`: beam search.

mt_testlib's copy of Lingvo's MT task has no `Inference()`, so the export of
`mt_testlib.MODEL` is refused (one `error:` line naming the method).
`SERVED_MODEL` is the same experiment (same task params, so it restores the
same checkpoints) whose task adds the subgraph an MT user writes:

  default: src_ids int32 [batch, time], src_paddings float32 [batch, time]
    (NmtInput's batch-major src) -> topk_decoded string [batch, beam],
    topk_scores float32 [batch, beam], topk_ids int32 [batch * beam, time],
    topk_lens int32 [batch * beam]

the task's encoder and beam search (`enc.FPropDefaultTheta`,
`dec.BeamSearchDecode`, as Lingvo's `_InferenceSubgraph_Default`) on fed ids.
`Write(dir)` writes its module beside mt_testlib's.
"""

import os

from tests.support import mt_testlib

MODULE = 'lingvo_mt_serving'
SERVED_MODEL = MODULE + '.GPipeMtServed'

_SOURCE = '''
"""mt_testlib's GPipe NMT experiment with an Inference() (beam search)."""
import lingvo.compat as tf
from lingvo import model_registry
from lingvo.core import py_utils

import %(base)s as base


class GPipeTransformerServedModel(base.GPipeTransformerModel):
  """The NMT task with Lingvo's inference subgraph: beam search on ids."""

  def Inference(self):
    with tf.name_scope('inference'):
      src_ids = tf.placeholder(tf.int32, [None, None], name='src_ids')
      src_paddings = tf.placeholder(tf.float32, [None, None],
                                    name='src_paddings')
      encoder_outputs = self.enc.FPropDefaultTheta(
          py_utils.NestedMap(ids=src_ids, paddings=src_paddings))
      out = self.dec.BeamSearchDecode(encoder_outputs)
      decoded = self.input_generator.IdsToStrings(
          out.topk_ids, out.topk_lens - 1, self._GetTokenizerKeyToUse('tgt'))
      fetches = {
          'topk_decoded': tf.reshape(decoded, tf.shape(out.topk_hyps)),
          'topk_scores': tf.reshape(out.topk_scores, tf.shape(out.topk_hyps)),
          'topk_ids': out.topk_ids,
          'topk_lens': out.topk_lens,
      }
      feeds = {'src_ids': src_ids, 'src_paddings': src_paddings}
      return {'default': (fetches, feeds)}


@model_registry.RegisterSingleTaskModel
class GPipeMtServed(base.GPipeMt):
  """GPipeMt, its task with Inference()."""

  def Task(self):
    p = super().Task()
    p.cls = GPipeTransformerServedModel
    return p
'''


def Write(root):
  """Writes the served experiment's module into `root` (mt_testlib's)."""
  with open(os.path.join(root, MODULE + '.py'), 'w') as f:
    f.write(_SOURCE % {'base': mt_testlib.MODULE})
