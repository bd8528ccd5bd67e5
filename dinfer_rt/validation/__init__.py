"""Cross-hardware validation: prove a backend against the float64 reference, op by op and
token by token. Entry points: ``dinfer-rt validate`` and ``pytest --pyargs dinfer_rt.validation
--dinfer-backend=NAME``."""
