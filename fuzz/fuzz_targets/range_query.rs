//! `range_query`: see `tollgate_gateway::fuzz::range_query`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate_gateway::fuzz::range_query(data));
