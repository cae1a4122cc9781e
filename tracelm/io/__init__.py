"""File formats: model readers, weight store, tokenizers, chat templates, registry, configs."""
