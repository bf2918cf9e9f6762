//! The store's own tests.
