"""The two fresh processes of tests/serving/test_serving.py (one CPU device
each).

  python tests/support/serving_probe.py lingvo ARGS.json  # evaler, decoder,
                                                         # Predictor
  python tests/support/serving_probe.py saved_model ARGS.json  # TF only

`lingvo` builds the experiment's evaler (and the LM's decoder) on the
checkpoint, runs them on the first dev batch, feeds the same batch to Lingvo's
Predictor over the exported inference graph, and saves every number in
ARGS['out'] (npz). `saved_model` imports TensorFlow alone, feeds the batch
saved by `lingvo` to the SavedModel's signatures, asserts that neither
lingvo nor lingvo_ext was imported, and saves the outputs.
"""

import json
import sys


def _Lingvo(args):
  from lingvo_ext import entry_point  # pylint: disable=unused-import,g-import-not-at-top
  # isort: split
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top
  from lingvo.core import cluster_factory  # pylint: disable=g-import-not-at-top
  from lingvo.core import predictor  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from lingvo_ext.tasks import experiment_params  # pylint: disable=g-import-not-at-top
  tf.flags.FLAGS([sys.argv[0]])
  model, ckpt, kind = args['model'], args['checkpoint'], args['kind']

  def Build(job, overrides, make):
    cfg = experiment_params.GetParams(model, 'Dev', overrides)
    cfg.cluster.mode = 'sync'
    cfg.cluster.job = job
    cfg.cluster.do_eval = True
    cfg.cluster.add_summary = False
    cfg.cluster.task = 0
    for name in ('evaler', 'decoder'):
      cfg.cluster.Get(name).Set(name='/job:localhost', replicas=1)
    with tf.Graph().as_default(), cluster_factory.Cluster(cfg.cluster):
      task = cfg.Instantiate().GetTask()
      fetches = make(task, task.input_generator.GetPreprocessedInputBatch())
      with tf.Session() as sess:
        tf.train.Saver().restore(sess, ckpt)
        return sess.run(fetches)

  def Evaler(task, batch):
    _, per_example = task.FPropDefaultTheta(batch)
    out = {'evaler_loss': per_example['loss']}
    for k in ('ids', 'labels', 'weights', 'data', 'label', 'paddings'):
      if k in batch:
        out['batch_' + k] = batch[k]
    if kind == 'lingvo_lm':  # The batch as text, for the text feed.
      lengths = tf.cast(tf.reduce_sum(batch.weights, 1), tf.int32) - 1
      out['batch_text'] = task.input_generator.IdsToStrings(
          batch.labels, lengths)
    return out

  out = Build('evaler', args.get('overrides', ''), Evaler)
  pred = predictor.Predictor(args['inference_graph'], checkpoint=ckpt,
                             device_type='cpu')
  if kind == 'lm':
    keys = ['log_probs', 'per_example_log_pplx', 'per_example_log_prob']
    vals = pred.Run(keys, subgraph_name='default', ids=out['batch_ids'],
                    labels=out['batch_labels'], weights=out['batch_weights'])
    out.update({'predictor_' + k: v for k, v in zip(keys, vals)})
    prefix = args['prefix_len']
    for name, temperature in (('greedy', 0.0), ('sampled', 1.0)):
      dec = Build('decoder', (f'task.decode_temperature:{temperature};'
                              f'task.decode_prefix_len:{prefix};'
                              'task.decode_seed:1234'),
                  lambda task, batch: task.Decode(batch))
      out[f'decoder_{name}'] = dec['sample']
      out[f'predictor_{name}'] = pred.Run(
          ['ids'], subgraph_name='generate',
          prefix=out['batch_ids'][:, :prefix],
          max_len=out['batch_ids'].shape[1], temperature=temperature,
          top_k=0, seed=1234)[0][:, prefix:]
  elif kind == 'image':
    keys = ['probs', 'top_class']
    vals = pred.Run(keys, subgraph_name='default', images=out['batch_data'])
    out.update({'predictor_' + k: v for k, v in zip(keys, vals)})
  else:  # A Lingvo task LM: its own default subgraph, fed text.
    keys = ['log_pplx_per_sample', 'lengths']
    vals = pred.Run(keys, subgraph_name='default', text=out['batch_text'])
    out.update({'predictor_' + k: v for k, v in zip(keys, vals)})
  out = {k: np.array(v.tolist(), dtype=bytes) if v.dtype == object else v
         for k, v in out.items()}  # Strings, readable without pickle.
  np.savez(args['out'], **out)


def _SavedModel(args):
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if args.get('op_library'):
    tf.load_op_library(args['op_library'])
  model = tf.saved_model.load(args['export_dir'])
  batch = dict(np.load(args['batch'], allow_pickle=False))
  out = {'signatures': np.array(sorted(model.signatures.keys()))}
  kind = args['kind']
  if kind == 'lm':
    res = model.signatures['default'](
        ids=tf.constant(batch['batch_ids']),
        labels=tf.constant(batch['batch_labels']),
        weights=tf.constant(batch['batch_weights']))
    out.update({'saved_' + k: v.numpy() for k, v in res.items()})
    prefix = args['prefix_len']
    ids = batch['batch_ids']
    for name, temperature, seed in (('greedy', 0.0, 1234),
                                    ('sampled', 1.0, 1234),
                                    ('sampled_again', 1.0, 1234),
                                    ('top_k', 0.7, 5)):
      gen = model.signatures['generate'](
          prefix=tf.constant(ids[:, :prefix]),
          max_len=tf.constant(ids.shape[1]),
          temperature=tf.constant(temperature),
          top_k=tf.constant(3 if name == 'top_k' else 0),
          seed=tf.constant(seed))['ids'].numpy()
      out[f'saved_{name}'] = gen[:, prefix:]
      out[f'saved_{name}_prefix'] = gen[:, :prefix]
    body = args.get('rest_body')
    if body:  # TF Serving's columnar request: inputs by signature name.
      sig = model.signatures[body['signature_name']]
      specs = sig.structured_input_signature[1]
      assert sorted(body['inputs']) == sorted(specs), (body, specs)
      res = sig(**{k: tf.constant(v, dtype=specs[k].dtype)
                   for k, v in body['inputs'].items()})
      out['rest_outputs'] = res['ids'].numpy()
    out['vocab'] = np.array(
        open(model.assets['vocab.json'].asset_path.numpy().decode()).read())
  elif kind == 'image':
    res = model.signatures['default'](images=tf.constant(batch['batch_data']))
    out.update({'saved_' + k: v.numpy() for k, v in res.items()})
    half = batch['batch_data'][:1]  # Any batch size: one image alone.
    out['saved_probs_batch1'] = model.signatures['default'](
        images=tf.constant(half))['probs'].numpy()
  else:
    res = model.signatures['default'](text=tf.constant(batch['batch_text']))
    out.update({'saved_' + k: v.numpy() for k, v in res.items()
                if v.dtype != tf.string})
  imported = [m for m in ('lingvo', 'lingvo_ext') if m in sys.modules]
  assert not imported, imported
  np.savez(args['out'], **out)


if __name__ == '__main__':
  with open(sys.argv[2]) as f:
    _args = json.load(f)
  {'lingvo': _Lingvo, 'saved_model': _SavedModel}[sys.argv[1]](_args)
