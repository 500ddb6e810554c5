"""Untrusted programs (model-written code) in a bubblewrap sandbox: limits, verdicts, a pool of
ready sandboxes, per-episode interpreters, and `lockstep sandbox run`."""
