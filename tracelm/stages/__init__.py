"""Pure stage functions over frozen records. numpy/numexpr and tracelm.state only: no files, no logs."""
