"""GPU-to-NPU migration tools: the offline converter (``opennpu.migrate.convert``, run with
``python -m opennpu.migrate`` or ``opennpu migrate``) and the runtime patches."""
