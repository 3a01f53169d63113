"""The schedule function of every record: what PipeliningLayer calls.

A schedule function has one signature,

  Schedule(layer, theta, inputs, num_micro_batches) -> outputs

where `layer` is the `gpipe.PipeliningLayer` (its cells, devices and params),
`theta` its weights, `inputs` the tuple of FProp inputs after the layer's
`before_tpl` layers and `outputs` the last cell's outputs for the whole batch.
A record with a generator runs on the interpreter; 'recurrent' is Lingvo's
loop.
"""

from lingvo_ext.core.engine import interpreter
from lingvo_ext.core.engine import records
from lingvo_ext.core.engine import recurrent

SCHEDULES = {
    r.name: (interpreter.ListSchedule(r.name) if r.generator else
             recurrent.Recurrent) for r in records.RECORDS
}
