"""Drafters for a verifier trained elsewhere (an imported checkpoint, or any bundle), learnt from its
own greedy outputs: the work of `specdec distill`.

Sequence-level knowledge distillation (Kim and Rush 2016): the verifier decodes the user's
unlabelled sources greedily (`labels`: batched by `greedy_labels`, chunk by chunk through
`training.beam_relabel`, which makes the labelling resumable), and the NAR block drafter (and,
optionally, a small AR drafter) learns those outputs with the project's own objectives and batching
(`drafters`: `training.train.train_role`, k [MASK]s after a causal prefix with glancing for the NAR
drafter, teacher forcing for the AR one). Greedy output is what GAD's drafts are checked against,
so it is the target. The drafters' shapes and starting weights are `drafter_models`'s.

The options are one `options.DistillOptions`, made once by the command and read top-down by
`run.distill`, which turns them into the labelling's settings and one `drafters.DrafterPlan` per
drafter; nothing below reads the options again. Everything resumable lives in a work directory
(`work`): the labelled pairs, each drafter's checkpoints and logs. Rerunning the same command
continues where it stopped; a finished drafter is not trained again. The new bundle is a copy of the
old one with the drafters added and a section appended to its MODEL_CARD.md (`bundle`).

Import the modules themselves: this package imports nothing eagerly.
"""
