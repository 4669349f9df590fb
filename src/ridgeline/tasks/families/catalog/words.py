"""Word lists the families draw names and contents from (plain data, no meaning)."""

NOUNS = ("apple", "river", "stone", "cloud", "maple", "harbor", "signal", "copper", "falcon",
         "garden", "lantern", "meadow", "orbit", "pepper", "quartz", "raven", "saddle",
         "timber", "velvet", "willow", "anchor", "beacon", "canyon", "delta", "ember",
         "fjord", "glacier", "island", "jasper", "kernel", "ledger", "mosaic", "nectar")
NAMES = ("alice", "bruno", "chen", "dana", "elif", "farid", "greta", "hiro", "ines", "jonas",
         "kofi", "lena", "mateo", "nora", "omar", "priya", "quinn", "rosa", "sven", "tomas",
         "uma", "viktor", "wen", "yara", "zoe")
SERVICES = ("auth", "billing", "cache", "gateway", "indexer", "mailer", "payments",
            "scheduler", "search", "storage", "worker")
LEVELS = ("INFO", "WARN", "ERROR", "DEBUG")
