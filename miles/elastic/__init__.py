"""Elastic hybrid training's decisions: who owns each GPU (`ledger`) and when to borrow or return (`policy`).

Pure logic, no Ray and no I/O: the runtime feeds observations in and carries decisions out. The training
side (lanes, fencing, state equality) is miles/train/hybrid. Design: docs/elastic.md.
"""
