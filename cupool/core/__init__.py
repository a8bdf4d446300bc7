"""Mechanism: the state of a pool and the rules that keep it consistent.

Nothing here decides policy (when to grow, what to reclaim): that is the pool's
and the pressure layer's job.  See docs/design.md.
"""
