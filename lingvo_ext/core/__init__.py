"""lingvo_ext/core/: the pipeline layer and Lingvo's faces.

`gpipe.py` (`PipeliningLayer`, Lingvo's names) and `layers_with_gpipe.py`
(Lingvo's GPipe Transformer stacks on it) are where Lingvo users import
them from; `from_lingvo.py` runs a Lingvo experiment's GPipe layers on
lingvo_ext's engine; `seq_layer.py` places cells and their variables;
`stacking.py` stacks variables of equal layers; `precision.py` bfloat16;
`jit_choice.py` XLA's build of a pipeline. The schedule and the cut are in
lingvo_ext/pipeline/, the layer library in lingvo_ext/layers/.
"""
