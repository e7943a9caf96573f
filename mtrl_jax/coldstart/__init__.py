"""The cold start (the ``warmup.*`` config keys): supervised training on scripted, deliberately imperfect
demonstrations of the tool protocol, before RL. The tiny default and the fetched instruction-tuned checkpoints
alike need it: none of them uses the protocol on its own (every fetched one scores 0, docs/real_models.md).

* ``teacher``: the scripted teacher and the question rewrites;
* ``demonstrations``: its episodes through the episode driver, rejection sampling, best-of-n, hop drills;
* ``sft``: the supervised step and its loop;
* ``stage``: the stage of a run: resume, and the policy a work directory holds (``restore_policy``);
* ``settings``: ``ColdStartSettings``, the one object all of them read;
* ``masks``: loss masks read as turns.
"""
