//! complete_in.
