"""The trainer's flags, one declarative table of `table.Flag` rows per concern.

model.py (model, MLA), moe.py, parallel.py (parallelism, pipeline), training.py (length,
schedule, recompute, batch ramp-up, memory), data.py (data, tokenizer, validation), logging.py
(logging, profiling), checkpoint.py (checkpoints, run control); the no-effect and refused rows
are in arguments/no_effect.py and the optimizer's in arguments/optimizer_args.py.
arguments/parser.py builds the parser from them. Nothing here imports torch or megatron-core.
"""
