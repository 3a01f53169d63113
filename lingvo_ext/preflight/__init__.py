"""lingvo_ext/preflight/: the checks a run passes before anything is written.

One home for them, called by the trainer (`param_checks.Check`), the
launcher (`start_memory.LaunchWarnings`, per task, before the tasks start)
and the planner's `--plan=auto` (`memory_check.CheckAutoPlan`):

- param_checks: the experiment's params as built, every pipeline's
  schedule, cut and micro-batches (pipeline_tree.CheckPipelines, the
  schedule records' refusals), gradient sync, bfloat16;
- dataset_checks: every dataset the jobs read (files, vocabularies, batches
  against the pipelines, lengths against buckets);
- start_memory: the memory model's estimate at start against the machine's
  or the cgroup's limit, and the override that fits;
- memory_check: the memory a process may use, and the built graph's
  variables against it.

A failed check is one `error:` line and exit 2; a warning is one line.
"""
