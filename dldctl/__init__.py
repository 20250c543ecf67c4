"""dldctl: operate Decoupled DiLoCo training runs (provision, supervise, break on purpose, watch)."""

__version__ = "0.1.0"
