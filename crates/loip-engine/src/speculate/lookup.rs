//! Prompt-lookup drafting: propose the tokens that followed the latest earlier occurrence of
//! the context's last n-gram (no second model).
//!
//! Pure: a function of the context's token ids. The longest n-gram that matches wins (from
//! `ngram_max` down to `ngram_min`); among matches of that length the most recent one wins,
//! since text being copied (an edit, a summary quoting its source) is usually copied in
//! order. A match whose continuation runs into the context's end proposes what it can.

/// The n-gram lengths prompt lookup tries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lookup {
    /// the longest n-gram matched // tokens
    pub ngram_max: usize,
    /// the shortest n-gram matched (at least 1) // tokens
    pub ngram_min: usize,
}

impl Default for Lookup {
    fn default() -> Self {
        Lookup {
            ngram_max: 3,
            ngram_min: 2,
        }
    }
}

impl Lookup {
    /// Up to `k` draft tokens to follow `context`, empty when no n-gram of the configured
    /// lengths recurs.
    pub fn draft(&self, context: &[u32], k: usize) -> Vec<u32> {
        let n = context.len();
        if k == 0 {
            return Vec::new();
        }
        let lo = self.ngram_min.max(1);
        for len in (lo..=self.ngram_max.min(n.saturating_sub(1))).rev() {
            let tail = &context[n - len..];
            // latest start `s < n - len` with context[s..s + len] == tail
            if let Some(s) = (0..n - len).rev().find(|&s| &context[s..s + len] == tail) {
                let from = s + len;
                let to = (from + k).min(n);
                return context[from..to].to_vec();
            }
        }
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_what_followed_the_latest_longest_match() {
        let l = Lookup {
            ngram_max: 3,
            ngram_min: 1,
        };
        // "1 2 3 9" earlier, then "5 2 3 8", context ends in "2 3": the latest 2-gram match
        // (at 5) wins over the earlier one, and no 3-gram "x 2 3" with x = 4 recurs
        let ctx = [1, 2, 3, 9, 5, 2, 3, 8, 4, 2, 3];
        assert_eq!(l.draft(&ctx, 2), vec![8, 4]);
        // a 3-gram match beats a later 2-gram one
        let ctx = [7, 2, 3, 6, 6, 1, 2, 3, 5, 0, 7, 2, 3];
        assert_eq!(l.draft(&ctx, 3), vec![6, 6, 1]);
        // the continuation stops at the context's end
        let ctx = [4, 4, 4];
        assert_eq!(l.draft(&ctx, 5), vec![4]);
        assert_eq!(l.draft(&ctx, 0), Vec::<u32>::new());
    }

    #[test]
    fn no_match_no_draft() {
        let l = Lookup::default();
        assert!(l.draft(&[1, 2, 3, 4, 5, 6], 4).is_empty());
        assert!(l.draft(&[], 4).is_empty());
        assert!(l.draft(&[3], 4).is_empty());
        // a 1-gram match is below ngram_min = 2
        assert!(l.draft(&[1, 2, 3, 1], 4).is_empty());
    }
}
