"""The XLA path: `device=tpu` (Cloud TPU) and `device=xla` (any jax backend; jax's CPU devices in the tests).

ember's own nn.Modules run as jax functions through torchax (PyTorch on JAX), compiled by XLA and sharded by
GSPMD over a `jax.sharding.Mesh` built from the same ici_mesh / dcn_mesh keys as the torch.distributed path.
Nothing outside this package imports jax or torchax, and this package is imported only when the device is
tpu or xla (tests/test_imports.py): the CPU/CUDA paths never need the `.[tpu]` extra.

runtime.py   torchax imported (with the shim torch 2.13 needs), the devices, jax.distributed on TPU pods
mesh.py      MeshShape -> jax Mesh (hybrid ICI x DCN for multi-slice), the batch's sharding
sharding.py  each parameter's PartitionSpec, from the family's tensor-parallel plan and the fsdp/expert axes
step.py      the jit-compiled train step: forward, backward, gradient accumulation, clip, AdamW (optax)
checks.py    what the engine refuses, from the config alone; rules.py its registry entry (mesh, dtype); no jax
engine.py    XlaEngine: the Trainer's engine with this step; weights and optimizer state as sharded jax arrays
"""
