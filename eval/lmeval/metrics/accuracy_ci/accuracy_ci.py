"""An `evaluate` metric: accuracy with its 95 % Wilson score interval (predictions, references: integer labels).
Loaded from this folder (`evaluate.load(path)`), so it needs no Hub access."""
import math

import datasets
import evaluate

Z95 = 1.959963984540054


class AccuracyCI(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Accuracy with a 95 % Wilson score confidence interval.",
            citation="Wilson, E. B. (1927). Probable inference, the law of succession, and statistical inference.",
            inputs_description="predictions, references: lists of integer labels of equal length",
            features=datasets.Features({"predictions": datasets.Value("int64"),
                                        "references": datasets.Value("int64")}))

    def _compute(self, predictions, references):
        n = len(references)
        if n == 0:
            raise ValueError("accuracy_ci: no examples")
        k = sum(int(p == r) for p, r in zip(predictions, references))
        p, z2 = k / n, Z95 * Z95
        centre = (p + z2 / (2 * n)) / (1 + z2 / n)
        half = Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
        return {"accuracy": p, "ci_low": max(0.0, centre - half), "ci_high": min(1.0, centre + half), "n": n}
