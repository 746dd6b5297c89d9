"""The decoder families the native engine runs: their forwards over a paged KV cache, on the
kernels' operations, read in place from the policy's own transformers modules (`families` picks
the forward of a model type; `model` holds the Llama layout's, `gemma` Gemma 3's, `moe` the
sparse layers', `batch_invariant` the one on the batch-invariant kernels; `adapters` and
`moe_adapters` add LoRA products inside them, `fusion` lays sibling projections back to back)."""
