"""The 🤗 Trainer integration's public import path: ``from accelerate_stateful.transformers import StatefulTrainer``.

The implementation lives in ``accelerate_stateful/integrations/`` with the other integrations.
"""

from .integrations.transformers import SUPPORTED_TRANSFORMERS, StatefulTrainer, StatefulTrainerMixin, stateful

__all__ = ["SUPPORTED_TRANSFORMERS", "StatefulTrainer", "StatefulTrainerMixin", "stateful"]
