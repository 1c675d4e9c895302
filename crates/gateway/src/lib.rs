//! tollgate runtime
