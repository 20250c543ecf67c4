"""A run's life: from an inventory to a resolved plan, hosts provisioned and processes launched (`up`),
checked before (`check`), changed while live (`converge`: learner add/remove), and stopped (`down`)."""
