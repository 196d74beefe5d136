"""The pieces the modes are built from, written once against `core.interfaces`: the draft-verify
loop and its stats, the accept rules, beam search, the drafter delta sync (IAD's copy drafter is
`core.copy_draft`: the verifier service runs it too)."""
