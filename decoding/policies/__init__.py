"""The pieces the modes are built from, written once against `core.interfaces`: the draft-verify
loop and its stats, the accept rules, IAD's copy drafter, beam search, the drafter delta sync."""
