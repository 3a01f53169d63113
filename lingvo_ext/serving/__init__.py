"""From a trained model to predictions: inference graphs and SavedModels.

`inference`: the params rewrite that exports a pipelined model as its
sequential model on one device; `saved_model`: Lingvo's inference graph and
the TF2 SavedModel of a checkpoint; `export`: the checks and the command
line of `lingvo-ext-export`. See docs/serving.md.
"""
