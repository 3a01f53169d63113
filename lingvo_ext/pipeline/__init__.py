"""lingvo_ext/pipeline/: the schedule, the cut and the engine.

One concept per module, lower layers first; no module imports one above it.

The schedule:

- kinds: actions (`Kind`, `Action`) and the pipeline's description
  (`StageSpec`, stage placement).
- runs, simulate, transforms, text: reading, checking, simulating,
  reshaping a schedule's lists, and writing them as text and back.
- generators: one function per schedule from a `StageSpec` to its lists.
- records: one `Schedule` record per schedule; every schedule table derives
  from them.
- schedules: the public face (the lists API and `SCHEDULES`, the schedule
  function of each record, its TensorFlow half imported on first use).

The cut:

- cells: `FeatureExtractionLayer` and `PartitionSequentialLayers`, a stack
  cut into cells; cuts: the exact min-max cut by FLOPs, params or time;
  partitioning: the partitioner's search; cost: layers measured in
  TensorFlow; cut_checkpoints: a checkpoint of one cut restored into
  another; nest_util: the cells' nested inputs and outputs.

The graph side (TensorFlow):

- graph_state, jit_random, matmul_grad, gemm_rewrite, cell_function:
  graph bookkeeping, random ops under XLA, the matmul gradient override,
  weight matmuls as one 2-D GEMM, and a cell as a function built once and
  called per micro-batch.
- randomness, custom_gradient, weight_gradients, tensors: per-micro-batch
  random seeds, a pipeline's own backward function, the one owner of weight
  gradients, small helpers on the engine's tensors.
- loss: what the caller's loss lets the backward lists do.
- interpreter: builds a schedule's lists as a graph, one method per kind.
- recurrent: Lingvo's StackedRecurrent loop ('recurrent').

The modules up to records need no TensorFlow (the planner imports them);
this package's __init__ imports nothing. The layer that runs a pipeline,
`PipeliningLayer`, is lingvo_ext/core/gpipe.py (Lingvo's face).
"""
