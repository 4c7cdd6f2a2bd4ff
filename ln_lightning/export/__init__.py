"""Shipping a converted model: Hugging Face directories (``hf``), native pre-norm classes (``native``), the
remote code that computes the converted function without ln_lightning (``remote_runtime``), the converted model's
own ``save_pretrained`` (``save_guard``) and ``ln-lightning export`` (``cli``).

The public names are ``ln_lightning.save_pretrained``, ``ln_lightning.from_pretrained`` and ``ln_lightning.to_native``.
"""
