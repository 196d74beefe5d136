"""The model backends the verifier and the NAR drafter can run on, and the default one."""

BACKENDS = ("torch", "onnxruntime")
DEFAULT_BACKEND = "onnxruntime"
