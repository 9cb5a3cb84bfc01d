"""The gateway's services: the work between the routes (which parse and answer) and the runtime.

`BaseModels` answers which base models this server has; `TrainingService` owns model records, the
ordered training operations, checkpoints and sampler publishing; `SamplingService` owns target
resolution and the sampling limits, for the Tinker and the OpenAI routes alike.
"""
