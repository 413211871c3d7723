# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The shared multiplexer process (one per controller user, started by the first worker).

Links to sessions over the gRPC agent or the documented exec API, transfers, module runners.
"""
