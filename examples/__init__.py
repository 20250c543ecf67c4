"""Examples of extending dldctl: `examples.custom_model:factory` is a user's own model."""
