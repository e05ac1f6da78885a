"""Fault-injection campaigns: one training command run under every entry of a list of faults and
strengths (and a baseline), a few at a time, resumable, into a signature library.

    load_config(path) -> CampaignConfig          (config: the JSON file, expanded into entries)
    run_campaign(config) -> CampaignResult       (runner: processes, resumption, the library)
"""
