"""The Lingvo internals lingvo_ext/runtime/ depends on, as data.

The runtime's runners subclass Lingvo's (lingvo/runners.py,
lingvo/base_runner.py, lingvo/trainer.py), override some of their private
methods, read and set their private attributes, and copy two methods whole.
tests/_internal/ checks every entry against the installed Lingvo (it
exists, its signature, the copied sources' hashes) and that the runtime's
classes use no other private name of Lingvo's, so an upgrade fails with a
name, not by behaviour. docs/architecture.md lists them for readers.
"""

# (Lingvo class, method, its signature): private methods the runtime's
# runners override. Each override calls Lingvo's through super() and adds
# around it; the signature must stay as listed.
OVERRIDES = (
    ('lingvo.base_runner.BaseRunner', '_CreateCheckpointer',
     '(self, train_dir, model)'),
    ('lingvo.base_runner.BaseRunner', '_DequeueThreadComplete', '(self)'),
    ('lingvo.base_runner.BaseRunner', '_FindNewCheckpoint',
     '(self, sess=None, processed_ckpts=None)'),
    ('lingvo.base_runner.BaseRunner', '_GetSession', '(self, **kwargs)'),
    ('lingvo.base_runner.BaseRunner', '_RunLoop',
     '(self, job_name, loop_func, loop_args=(), cleanup_func=None)'),
    ('lingvo.base_runner.BaseRunner', '_SetStatusMessage',
     '(self, message, retrying=False)'),
    ('lingvo.base_runner.BaseRunner', '_ShouldStop',
     '(self, sess=None, step=None, check_early_stop=True) -> bool'),
    ('lingvo.base_runner.BaseRunner', '_TrainerFinished',
     '(self, sess=None) -> bool'),
    ('lingvo.base_runner.BaseRunner', '_WaitUntilInit',
     '(self, sess=None, start_up_delay_steps=None)'),
    ('lingvo.base_runner.BaseRunner', '_WriteSummaries',
     '(self, summary_writer, job_name, global_step, summaries, '
     'text_filename=None)'),
    # A copy (COPIED), not a wrapper: its loop has no hook for the wait.
    ('lingvo.runners.Controller', '_Loop', '(self)'),
    # Wrapped: Lingvo's loop, then the thread marked complete.
    ('lingvo.runners.Decoder', '_Loop', '(self)'),
    ('lingvo.runners.Evaler', '_Loop', '(self)'),
    ('lingvo.trainer.RunnerManager', '_CreateRunner',
     '(self, job, model_task_name, logdir, tf_master, trial)'),
)

# {Lingvo class: private methods and attributes the runtime calls, reads or
# sets without overriding them}. Attributes are those Lingvo's own methods
# set on `self` (the test finds `self.<name>` in the class's source).
USES = {
    'lingvo.base_runner.BaseRunner': (
        '_CreateSummaryWriter', '_DequeueThreadComplete', '_ExportMetrics',
        '_SetStatusMessage', '_ShouldStop', '_WaitUntilInit', '_WriteToLog',
        '_checkpointer', '_cluster', '_container_id',
        '_dequeue_thread_complete', '_global_step_var', '_graph',
        '_initialize_tables', '_job_name', '_logdir', '_model_task_name',
        '_params', '_summary_writer', '_tf_master', '_train_dir'),
    'lingvo.runners.Controller': (
        '_SummarizeValue', '_checkpoint_in_controller', '_control_dir',
        '_initialize_global_vars', '_initialize_local_vars', '_model',
        '_model_analysis', '_summary_op', '_total_num_params'),
    'lingvo.runners.Decoder': ('_task',),
    'lingvo.runners.Evaler': ('_task',),
    'lingvo.trainer.RunnerManager': ('_tf_server',),
}

# {Lingvo method: sha256 of inspect.getsource(method)} for the methods the
# runtime copies and changes; a new Lingvo source fails the test, and the copy
# is then compared with it again and the hash updated.
COPIED = {
    # runtime/local_controller.py LocalController._Loop. Changed from
    # Lingvo's: --interactive comes from Options, not FLAGS; a controller
    # sharing the trainer's model (one_build.py) skips the initialisation the
    # trainer does, writes its run files from the loop and asks the trainer's
    # next step for the summaries; the save is an unblocking MaybeSave with a
    # disk-space warning; the last save sets RunState.final_save; the wait
    # between looks ends when this process's trainer stops (WaitForNextLook
    # instead of time.sleep).
    'lingvo.runners.Controller._Loop':
        '3d13034569b3ea64e00c8e72baa239853c56dccdf22c02bd23300a958f33e8c0',
    # runtime/one_build.py SharedModelControllerMixin.__init__, for a
    # controller sharing the trainer's model: it skips Lingvo's
    # Controller.__init__ (which builds a second model) and sets, in the
    # trainer's graph, every attribute that one sets (CONTROLLER_INIT_SETS).
    'lingvo.runners.Controller.__init__':
        'f954cae30741ef2e97fdf22c32434e51f6b05797c2b3693082543838bcf739ea',
}

# The attributes Lingvo's Controller.__init__ sets on `self`; the sharing
# controller (one_build.py) sets each of them itself.
CONTROLLER_INIT_SETS = (
    '_checkpoint_in_controller', '_checkpointer', '_control_dir',
    '_initialize_global_vars', '_initialize_local_vars', '_initialize_tables',
    '_job_name', '_model', '_model_analysis', '_params', '_summary_op',
    '_summary_writer', '_total_num_params', 'enqueue_ops')

# The trainer's session (local_trainer.py _TrainerSession) recognises
# Lingvo's training step by its fetches: a list whose first element is a
# task's train_op, as Trainer._Loop fetches it (whitespace removed here), and
# the global step fetched alone after it.
TRAIN_STEP_FETCHES = (
    'sess.run([task.train_op,task.eval_metrics,task.per_example_tensors,])',
    'sess.run(self._model.global_step)',
)
TRAIN_STEP_IN = 'lingvo.runners.Trainer._Loop'
