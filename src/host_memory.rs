//! This process's host memory as the kernel counts it (Linux `/proc/self/status`), for reports:
//! what a run needs of the host besides the GPU. The bundle's mapping counts where its pages are
//! resident (file-backed, reclaimable unless registered with the GPU driver), so a run that maps
//! a bundle shows it in its resident set as far as it touched it.

use serde::Serialize;

/// Bytes, each `None` where the kernel did not say.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct HostMemory {
    /// The resident set's peak (`VmHWM`).
    pub peak_rss_bytes: Option<u64>,
    /// The resident set now (`VmRSS`), and its anonymous and file-backed parts (`RssAnon`,
    /// `RssFile`).
    pub rss_bytes: Option<u64>,
    pub rss_anon_bytes: Option<u64>,
    pub rss_file_bytes: Option<u64>,
    /// Memory locked (`VmLck`) and pinned (`VmPin`).
    pub locked_bytes: Option<u64>,
    pub pinned_bytes: Option<u64>,
}

impl HostMemory {
    /// Read now; `None` where `/proc/self/status` cannot be read (not Linux).
    pub fn now() -> Option<HostMemory> {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .map(|s| HostMemory::parse(&s))
    }

    /// The fields of a `/proc/PID/status` text (values in kB).
    pub fn parse(status: &str) -> HostMemory {
        let field = |name: &str| {
            status.lines().find_map(|l| {
                let rest = l.strip_prefix(name)?.strip_prefix(':')?;
                let kb = rest.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()?;
                kb.checked_mul(1024)
            })
        };
        HostMemory {
            peak_rss_bytes: field("VmHWM"),
            rss_bytes: field("VmRSS"),
            rss_anon_bytes: field("RssAnon"),
            rss_file_bytes: field("RssFile"),
            locked_bytes: field("VmLck"),
            pinned_bytes: field("VmPin"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_status_fields_in_bytes() {
        let status = "Name:\tx\nVmPeak:\t  900 kB\nVmLck:\t       4 kB\nVmPin:\t       0 kB\n\
                      VmHWM:\t    2048 kB\nVmRSS:\t    1024 kB\nRssAnon:\t     512 kB\n\
                      RssFile:\t     500 kB\nThreads:\t3\n";
        let m = HostMemory::parse(status);
        assert_eq!(m.peak_rss_bytes, Some(2048 * 1024));
        assert_eq!(m.rss_bytes, Some(1024 * 1024));
        assert_eq!(m.rss_anon_bytes, Some(512 * 1024));
        assert_eq!(m.rss_file_bytes, Some(500 * 1024));
        assert_eq!(m.locked_bytes, Some(4096));
        assert_eq!(m.pinned_bytes, Some(0));
        // Missing or malformed fields are None, never a guess.
        let m = HostMemory::parse("VmHWM:\tlots kB\nVmRSS: 12\n");
        assert_eq!(m, HostMemory::default());
    }

    #[test]
    fn this_process_has_a_resident_set() {
        if let Some(m) = HostMemory::now() {
            let (peak, now) = (m.peak_rss_bytes.unwrap(), m.rss_bytes.unwrap());
            assert!(now > 0 && peak >= now, "{m:?}");
        }
    }
}
