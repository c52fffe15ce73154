"""The checkpoint formats, each one encoding on the one transaction
(:mod:`..transaction`): :mod:`.native` (mpidtensor's own, the default), :mod:`.dcp`
(torch DCP's file layout), :mod:`.safetensors` (Hugging Face's weights files)."""
