"""Shared IR analyses used by transform_ext ops and by schedule builders."""
