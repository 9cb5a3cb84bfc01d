"""Hybrid lanes: extra data-parallel replicas of a trainer on borrowed engine GPUs (issue 20).

The design and its invariants: docs/elastic.md.

A lane holds a full copy of the trainable state. A forward_backward's datums are split across the live lanes
(`partition`), gradients are summed over the lanes' own process group (`group`), each summed contribution is
fenced (`fence`), and the lanes' state is kept and checked equal (`state`).
"""
