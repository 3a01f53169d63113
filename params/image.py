"""Pipelined convolutional classifiers on images.

The default data is scikit-learn's 8x8 digits (ships in its wheel). To train
on a user's .npz of images ([N, H, W] or [N, H, W, C]) and integer labels,
subclass one of these with NPZ_FILE, DATA_SHAPE and NUM_CLASSES set, or
override them with, e.g. for 28x28 grey images of 10 classes,
--model_params_override='input.npz_file:/path/images.npz;
input.data_shape:(28, 28, 1); input.num_classes:10; task.num_classes:10'.
"""

from lingvo import model_registry

from lingvo_ext.tasks.image import input_generator
from lingvo_ext.tasks.image import model
from params import base


class _ConvClassifierBase(base.PipelinedExperiment):
  """Shared structure; the registered classes below set the sizes."""

  NPZ_FILE = ''  # Empty: sklearn digits.
  IMAGE_KEY = 'images'
  LABEL_KEY = 'labels'
  DATA_SHAPE = (8, 8, 1)
  NUM_CLASSES = 10
  BATCH_SIZE = 32
  STEM_CHANNELS = 32
  BLOCK_CHANNELS = [64, 128]
  CONVS_PER_BLOCK = 2
  LEARNING_RATE = 2e-3
  MAX_STEPS = 3000

  def _InputParams(self, split):
    return input_generator.ImageInput.Params().Set(
        npz_file=self.NPZ_FILE,
        image_key=self.IMAGE_KEY,
        label_key=self.LABEL_KEY,
        split=split,
        data_shape=tuple(self.DATA_SHAPE),
        num_classes=self.NUM_CLASSES,
        batch_size=self.BATCH_SIZE)

  def _TaskParams(self):
    return model.ConvClassifier.Params().Set(
        name='image',
        num_classes=self.NUM_CLASSES,
        stem_channels=self.STEM_CHANNELS,
        block_channels=list(self.BLOCK_CHANNELS),
        convs_per_block=self.CONVS_PER_BLOCK)


@model_registry.RegisterSingleTaskModel
class ConvClassifier(_ConvClassifierBase):
  """Stem 32, blocks 64 and 128 of two convs each; one pipeline cell."""


@model_registry.RegisterSingleTaskModel
class ConvClassifierGPipe(ConvClassifier):
  """ConvClassifier cut into 2 cells over 4 micro-batches.

  Run the cells in parallel with --num_cpu_devices=2 --worker_split_size=2.
  """
  NUM_PARTITIONS = 2
  NUM_MICRO_BATCHES = 4


@model_registry.RegisterSingleTaskModel
class ConvClassifierTiny(_ConvClassifierBase):
  """Stem 8, blocks 16 and 32 of one conv; trains in seconds on a CPU."""
  BATCH_SIZE = 16
  STEM_CHANNELS = 8
  BLOCK_CHANNELS = [16, 32]
  CONVS_PER_BLOCK = 1
  LEARNING_RATE = 3e-3
  MAX_STEPS = 40
  # The controller checks for the end of training this often, too.
  SAVE_INTERVAL_SECONDS = 5
  SUMMARY_INTERVAL_STEPS = 10


@model_registry.RegisterSingleTaskModel
class ConvClassifierTinyGPipe(ConvClassifierTiny):
  """ConvClassifierTiny in 2 cells over 2 micro-batches (same variables)."""
  NUM_PARTITIONS = 2
  NUM_MICRO_BATCHES = 2
