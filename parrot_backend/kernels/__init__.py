"""Triton kernels for paged attention, each beside a plain torch reference.

Importing this package never imports triton: the torch references work everywhere, and
the `*_triton` functions raise a clear ImportError only
when they are used on a machine without triton.

Kernels take tensors and plans and import nothing of the engine; the engine's Triton
attention backend that drives them is `parrot_backend.engine.triton_attention`.

Modules:
- `kv_store`: write new K/V rows into paged blocks through a slot mapping.
- `attention_kernel`: the one Triton attention kernel, driven by a list of work tiles.
- `decode`: paged decode attention (GQA, ragged lengths, split-KV).
- `extend`: prefill / extend attention over cached paged KV plus the new tokens.
- `merge`: log-sum-exp merge of partial attention states (split-KV, cascade).
- `shared_prefix`: decode for a group forked from one ancestor, reading its prefix once.
- `aot_check`: compile every kernel variant for a GPU target offline (no GPU needed).
"""

from __future__ import annotations
