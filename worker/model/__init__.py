"""The model floor: runners, batched generation, sampling, KV memory and adapters. Imports text."""
