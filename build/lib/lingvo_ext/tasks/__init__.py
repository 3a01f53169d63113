"""lingvo_ext's Lingvo tasks: a pipelined Transformer LM (lm/) and a
pipelined convolutional image classifier (image/), with input generators over
data that ships offline (pydoc_data.topics, scikit-learn's digits)."""
