"""Making and judging the default pair: corpus, training, distillation, and the pair evaluation
(prompt sets shared with bench/, measurements, step latency, model card)."""
