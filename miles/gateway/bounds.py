"""Bounds every JSON request body shares, whichever API it came through.

JSON integers are unbounded. One beyond int64 fits no tensor, engine field or store id: it overflowed in
float conversions, and a model_seq_id of 400 digits made a model id no later request could name.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

INT64_MAX = 2**63 - 1
# A field with its own Field bounds takes le=INT64_MAX there instead: an Annotated bound would replace
# that field's ge.
Int64 = Annotated[int, Field(ge=-(2**63), le=INT64_MAX)]
