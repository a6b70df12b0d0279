"""The ZAYA1 model: CCGQA attention (`attention`), the ZAYA1 router (`router`), dropless top-1 MoE (`moe`),
residual scaling (`layers`), the decoder (`transformer`), its shapes (`config`, `presets`) and the Hugging Face
key maps (`hf`)."""
