"""The pipeline engine: schedule records, their action lists, the interpreter.

One concept per module, lower layers first; no module imports one above it:

- kinds: actions (`Kind`, `Action`) and the pipeline's description
  (`StageSpec`, stage placement).
- runs, simulate, transforms, text: reading, checking, simulating,
  reshaping a schedule's lists, and writing them as text and back.
- generators: one function per schedule from a `StageSpec` to its lists.
- records: one `Schedule` record per schedule; every schedule table derives
  from them.
- graph_state, jit_random, matmul_grad, gemm_rewrite, cell_function
  (TensorFlow): graph bookkeeping, random ops under XLA, the matmul gradient
  override, weight matmuls as one 2-D GEMM, and a cell as a function built
  once and called per micro-batch.
- randomness, custom_gradient, weight_gradients (TensorFlow): per-micro-batch
  random seeds, a pipeline's own backward function, and the one owner of
  weight gradients.
- loss: what the caller's loss lets the backward lists do.
- interpreter: builds a schedule's lists as a graph, one method per kind.
- recurrent: Lingvo's StackedRecurrent loop ('recurrent').

The public face is `lingvo_ext.pipeline.schedules` (the lists API and
`SCHEDULES`, the schedule function of each record).

The modules up to records need no TensorFlow (the planner imports them);
this package's __init__ imports nothing.
"""
