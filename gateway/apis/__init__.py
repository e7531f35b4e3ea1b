"""The four inference APIs side by side, one package each in the same shape (`schema`, `translate`, `service`),
and their routes (`routes.py`)."""
