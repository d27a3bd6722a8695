"""The sandbox: one untrusted program run with limits in the strongest isolation this machine
offers (``isolation``), and long-lived per-worker sandboxes that fork a fresh run per program
(``zygote``). The code verifier's tests and the ``python`` tool both run here; it imports
nothing of honing's above the config layer."""
