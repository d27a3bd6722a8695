"""honing: reinforcement learning from verifiable rewards for language models.

The loop is generate -> score -> update; see docs/design.md for the layers. Importing this
package stays light: torch, transformers and tensorboard are imported where they are used.
"""

__version__ = "0.1.0"
