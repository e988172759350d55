"""Golden-output regression for the CosyVoice3 runtime: pinned cases (`cases.toml`), their expectations
from the torch reference (`data/`), and `cosyvoice-golden check` / `update`."""
