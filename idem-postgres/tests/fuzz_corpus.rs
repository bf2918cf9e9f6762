//! Fuzz corpus replay for the `stored_postgres` target.

// The stored-record decoder's corpus (`fuzz/corpus/stored_postgres/`), replayed through the
// `stored_postgres` target's body on stable Rust: stored bytes that once broke the decoder cannot
// break it again unnoticed. No server is needed: the body calls the decoder.
mod stored_postgres {
    use idem_conformance::fuzz_targets::{replay_stored_corpus, write_stored_seeds};
    use idem_postgres::fuzzing::{seed, stored_record};

    const TARGET: &str = "stored_postgres";

    #[test]
    fn every_committed_stored_record_corpus_file_decodes_or_is_refused() {
        let n = replay_stored_corpus(TARGET, stored_record);
        eprintln!("replayed {n} corpus files of {TARGET}");
    }

    /// The seed corpus: records as the store writes them (see `write_stored_seeds`).
    #[test]
    #[ignore = "writes files into fuzz/corpus; run by hand to regenerate the seeds"]
    fn write_seed_corpus() {
        write_stored_seeds(TARGET, seed);
    }
}
